"""Plot training and validation loss against iterations from a run's TensorBoard directory.

    python tools/plot_losses.py --tensorboard-dir demo_out/tensorboard --output demo_out/loss.png
Prints one summary line of JSON: first logged training loss, last validation loss, their ratio,
the mean tokens per second, the picture's path (null without matplotlib: pip install
matplotlib, or the [demo] extra).
"""

import argparse
import json
import sys


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(iteration, value)]} of every scalar the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot(scalars: dict, output: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for tag, label, style in (
        ("lm-loss", "training", "-"),
        ("validation lm-loss", "validation", "o-"),
    ):
        if scalars.get(tag):
            steps, values = zip(*scalars[tag], strict=True)
            ax.plot(steps, values, style, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def summary(scalars: dict) -> dict:
    train, valid = scalars.get("lm-loss", []), scalars.get("validation lm-loss", [])
    speed = [v for _, v in scalars.get("tokens-per-second", [])[1:]]  # the first has warm-up
    out = {
        "first_train_loss": train[0][1] if train else None,
        "final_validation_loss": valid[-1][1] if valid else None,
        "iterations": train[-1][0] if train else 0,
        "tokens_per_second": sum(speed) / len(speed) if speed else None,
    }
    if train and valid:
        out["ratio"] = out["final_validation_loss"] / out["first_train_loss"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensorboard-dir", required=True, help="the run's --tensorboard-dir")
    p.add_argument("--output", required=True, help="PNG file to write")
    p.add_argument("--title", default="GPT training on CPU", help="the plot's title")
    args = p.parse_args(argv)
    scalars = read_scalars(args.tensorboard_dir)
    if not scalars.get("lm-loss"):
        print(f"error: no lm-loss scalars in {args.tensorboard_dir}", file=sys.stderr)
        return 1
    out = summary(scalars)
    try:
        plot(scalars, args.output, args.title)
        out["plot"] = args.output
    except ImportError:
        print("no picture: pip install matplotlib (the demo extra)", file=sys.stderr)
        out["plot"] = None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
