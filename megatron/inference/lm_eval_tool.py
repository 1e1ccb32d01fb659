"""tools/lm_eval.py: lm-eval's command line with the "megatron" model registered; the model
is set up on every rank before lm-eval starts, so rank 0 can always stop the others (also
when lm-eval fails on a bad argument or task)."""

from __future__ import annotations

import sys

from megatron.inference.session import run_tool


def _model_args(argv: list[str]) -> dict:
    """load and pipeline_model_parallel_size from lm-eval's --model_args k=v,k=v."""
    from lm_eval.utils import simple_parse_args_string

    for i, arg in enumerate(argv):
        if arg.startswith("--model_args="):
            return simple_parse_args_string(arg.split("=", 1)[1])
        if arg == "--model_args" and i + 1 < len(argv):
            return simple_parse_args_string(argv[i + 1])
    return {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("error: lm-eval is not installed: pip install -e '.[eval]'", file=sys.stderr)
        return 1
    from megatron.inference import lm_eval_model

    model_args = _model_args(argv)

    def body() -> None:
        if "megatron" not in argv or "load" not in model_args:
            raise ValueError("give --model megatron --model_args load=CHECKPOINT_DIR[,...]")
        pp = int(model_args.get("pipeline_model_parallel_size", 1))
        leader = lm_eval_model.start(str(model_args["load"]), pp)
        if leader is None:  # a follower rank: rank 0 has finished
            return
        from lm_eval.__main__ import cli_evaluate

        saved = sys.argv
        sys.argv = [saved[0], *argv]
        try:
            cli_evaluate()
        finally:
            sys.argv = saved
            leader.stop()

    return run_tool(body)
