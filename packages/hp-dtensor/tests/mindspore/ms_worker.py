"""Run by msrun on each CPU worker: ``python ms_worker.py <module file> <function> <out dir>
[json args]``. Starts the MindSpore backend's process group, calls the function with the
arguments and pickles its result (or the traceback) to ``<out dir>/rank<r>.pkl``, so tests
can run one body under either framework (see ``run_mindspore``)."""

import importlib.util
import json
import os
import pickle
import sys
import traceback

os.environ.setdefault("HP_BACKEND", "mindspore")


def main(path, func, out_dir, args="[]"):
    from hp_dtensor import get_platform

    plat = get_platform("cpu")
    plat.init_process_group(None, 60, "cpu")
    rank = plat.get_rank()
    spec = importlib.util.spec_from_file_location("_body", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        result = ("ok", getattr(mod, func)(*json.loads(args)))
    except Exception:  # noqa: BLE001 - handed to the test, which fails with it
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    plat.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
