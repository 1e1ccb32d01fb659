"""Settings of training straight from loose JSON corpora (Megatron-LM's 2019 workflow):
`--train-data wikipedia --cache-dir cache --split 949,50,1`.

Each `--train-data` / `--valid-data` / `--test-data` value is a corpus name (looked up in
`--corpora-file` or `$MEGATRON_CORPORA`) or a path (file, glob or directory of .jsonl / .json /
.txt, optionally .gz). The first run tokenizes each corpus once with the run's tokenizer into
`--cache-dir` (megatron/data/loose_json.py); the run then trains from those mmap files exactly
as `--data-path` / `--train-data-path` would. The checks across fields are in config/rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting

CORPORA_ENV = "MEGATRON_CORPORA"  # the corpora file when --corpora-file is not given


@dataclass(frozen=True)
class LooseJsonConfig(Section):
    """Loose JSON corpora, tokenized once into --cache-dir, then trained like --data-path."""

    train_data: tuple[str, ...] = setting(
        (),
        "loose JSON training corpora: names from --corpora-file or paths (NAME [NAME ...], or "
        "W1 NAME1 W2 NAME2 ...); alone it is split by --split like --data-path, with "
        "--valid-data/--test-data the sets are separate like --train-data-path; several names "
        "blend by their token counts unless weights are given",
        metavar="NAME_OR_PATH",
    )
    valid_data: tuple[str, ...] = setting(
        (), "loose JSON validation corpora (names or paths); --split is then not used"
    )
    test_data: tuple[str, ...] = setting(
        (), "loose JSON test corpora (names or paths); --split is then not used"
    )
    text_key: str = setting("text", "the JSON key holding each document's text")
    corpora_file: str | None = setting(
        None,
        f"YAML file mapping corpus names to paths and optional weights (default: "
        f"${CORPORA_ENV} if set)",
    )
    presplit_sentences: bool = setting(
        False,
        "each document's lines are its sentences: one sequence per non-empty line (BERT-style "
        "sentence boundaries); documents still end where the record ends",
    )
    lazy_loader: bool = setting(
        False,
        "accepted for Megatron-LM 2019 scripts; it changes nothing because the tokenized "
        "corpus is always memory-mapped and read on demand",
    )
    resume_dataloader: bool = setting(
        False,
        "accepted for Megatron-LM 2019 scripts; it changes nothing because a resumed run always "
        "continues at the saved data position (consumed samples)",
    )
    cache_wait_minutes: float = setting(
        120.0,
        "how long ranks other than 0 wait for rank 0 to tokenize the corpora into --cache-dir",
        above=0,
    )

    @property
    def given(self) -> bool:
        return bool(self.train_data or self.valid_data or self.test_data)


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def parse_corpus_list(values: tuple[str, ...], flag: str) -> list[tuple[float | None, str]]:
    """`NAME [NAME ...]` -> [(None, name)]; `W1 NAME1 W2 NAME2 ...` -> [(weight, name)].

    Raises ValueError naming the flag when weights and names do not pair up."""
    if not values or not _is_number(values[0]):
        numbers = [v for v in values if _is_number(v)]
        if numbers:
            raise ValueError(
                f"{flag}: {numbers[0]!r} looks like a weight but the first value is a name. "
                "Fix: write either NAME1 NAME2 ... or W1 NAME1 W2 NAME2 ..."
            )
        return [(None, v) for v in values]
    if len(values) % 2:
        raise ValueError(
            f"{flag}: {len(values)} values start with a weight, so they must be weight/name "
            "pairs. Fix: write W1 NAME1 W2 NAME2 ..."
        )
    pairs = list(zip(values[0::2], values[1::2], strict=True))
    for w, name in pairs:
        if not _is_number(w) or float(w) < 0:
            raise ValueError(
                f"{flag}: {w!r} before {name!r} is not a weight >= 0. "
                "Fix: write W1 NAME1 W2 NAME2 ..."
            )
    if sum(float(w) for w, _ in pairs) <= 0:
        raise ValueError(f"{flag}: the weights sum to 0. Fix: give one corpus a positive weight")
    return [(float(w), name) for w, name in pairs]
