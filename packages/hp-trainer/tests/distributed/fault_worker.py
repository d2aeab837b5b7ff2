"""One rank of a test_faults.py job: ``LLMTrainer`` run as a plain process with torchrun's
environment variables, with a fault injected as ``argv[1]`` (JSON) says: a rank that hangs or
dies after a step, a rank whose forward returns NaN once, steps slowed down so that a signal
lands mid-run. Prints ``LOSSES <json>`` or ``PEERFAILURE <json message>`` as its last line."""

import json
import os
import sys
import time
from pathlib import Path

from hp_trainer import Callback, LLMTrainer, PeerFailure, load_config


class Fault(Callback):
    """Acts at the end of a step: sleeps (``sleep`` seconds, every rank), touches ``ready`` on
    rank 0 after step ``ready_step``, and on rank ``rank`` after step ``step`` hangs or dies."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec

    def on_step_end(self, trainer, step, metrics):
        s = self.spec
        if s.get("sleep"):
            time.sleep(s["sleep"])
        if s.get("ready") and trainer.rank == 0 and step == s["ready_step"]:
            Path(s["ready"]).touch()
        if trainer.rank == s.get("rank") and step == s.get("step"):
            if s["kind"] == "hang":
                time.sleep(3600)
            elif s["kind"] == "die":
                os._exit(3)


def main() -> None:
    spec = json.loads(sys.argv[1])
    trainer = LLMTrainer(load_config(None, spec["args"]), callbacks=[Fault(spec.get("fault", {}))])
    nan = spec.get("nan")  # {"rank": r, "call": k}: that rank's k-th forward returns NaN
    if nan is not None and trainer.rank == nan["rank"]:
        inner, calls = trainer.model.forward, [0]

        def forward(*args, **kwargs):
            calls[0] += 1
            out = inner(*args, **kwargs)
            return out * float("nan") if calls[0] == nan["call"] else out

        trainer.model.forward = forward
    try:
        losses = trainer.train()
    except PeerFailure as e:
        print("PEERFAILURE " + json.dumps(str(e)), flush=True)
        sys.exit(5)
    print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
