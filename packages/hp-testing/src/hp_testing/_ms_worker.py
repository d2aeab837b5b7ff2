"""Started by msrun for ``hp_testing.msrun.run_mindspore``: ``python _ms_worker.py <file>
<function> <out dir> <json args>``. Imports the file, calls the function and pickles
``("ok", result)`` or ``("error", traceback)`` to ``<out dir>/rank<RANK_ID>.pkl``."""

import importlib.util
import json
import os
import pickle
import sys
import traceback


def main(path, func, out_dir, args="[]"):
    rank = int(os.environ.get("RANK_ID", "0"))
    try:
        spec = importlib.util.spec_from_file_location("_hp_msrun_body", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        result = ("ok", getattr(mod, func)(*json.loads(args)))
    except Exception:  # noqa: BLE001 - handed to the test, which fails with it
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
