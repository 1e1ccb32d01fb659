"""Preprocessing throughput and memory, and index-building time, on a corpus every machine has.

    .venv/bin/python bench/preprocess.py [--mb 30] [--workers 2] [--docs 10000000]
    .venv/bin/python bench/preprocess.py --huge-doc-mb 60 [--workers 1]

1. ~30 MB of Python standard-library sources as JSONL; an 8k byte-level BPE trained on it.
2. tools/preprocess_data.py with --workers 1 and N: wall time, MB/s, peak RSS of the whole
   process tree (polled from /proc), and a check that both outputs are byte-identical.
3. GPT sample indices for a synthetic 10-million-document dataset, and a 2-way blend.
With --huge-doc-mb N, instead: one JSON line holding an N MB document (the same sources joined,
repeated if needed), preprocessed with the GPT-2-format BPE of tests/fixtures: wall time and
peak RSS (issue 30: a 60 MB line peaked at 7.1 GB), and the output's sha256 to compare runs.
Prints a table. Reference point from the data issue: Megatron-LM's own preprocess_data.py takes
about 22 s (1.4 MB/s) for this corpus on a 2-core machine.
"""

import argparse
import filecmp
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.data.blendable_dataset import build_blending_indices  # noqa: E402
from megatron.data.gpt_dataset import build_indices  # noqa: E402
from megatron.data.stdlib_corpus import stdlib_sources, write_stdlib_corpus  # noqa: E402

FIXTURE_BPE = os.path.join(ROOT, "tests", "fixtures", "megatron-mmap")


def _tree_rss(pid: int) -> int:
    """Resident bytes of pid and all its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        rss[p] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


def run_measured(cmd: list[str]) -> tuple[float, int]:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def poll():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    _, err = proc.communicate()
    t.join()
    if proc.returncode:
        sys.exit(f"command failed: {' '.join(cmd)}\n{err}")
    return time.monotonic() - start, peak[0]


def preprocess_cmd(corpus: str, prefix: str, bpe_dir: str, workers: int) -> list[str]:
    """tools/preprocess_data.py on `corpus` with the GPT-2-format BPE in `bpe_dir`."""
    return [
        *(sys.executable, f"{ROOT}/tools/preprocess_data.py", "--input", corpus),
        *("--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer"),
        *("--vocab-file", f"{bpe_dir}/vocab.json", "--merge-file", f"{bpe_dir}/merges.txt"),
        *("--append-eod", "--workers", str(workers)),
    ]


def write_huge_document(path: str, nbytes: int) -> int:
    """One JSON line {"text": ...} whose text is about `nbytes` of joined sources; its size."""
    parts, size = [], 0
    while size < nbytes:
        for _, text in stdlib_sources(nbytes - size):
            parts.append(text)
            size += len(text.encode("utf-8"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "\n".join(parts)}) + "\n")
    return os.path.getsize(path)


def bench_huge_document(mb: float, workers: int, out: str) -> None:
    corpus = os.path.join(out, f"huge{mb:g}.jsonl")
    size = write_huge_document(corpus, int(mb * 1e6))
    prefix = os.path.join(out, f"huge{mb:g}")
    secs, rss = run_measured(preprocess_cmd(corpus, prefix, FIXTURE_BPE, workers))
    digest = hashlib.sha256()
    for ext in (".bin", ".idx"):
        with open(f"{prefix}_text_document{ext}", "rb") as f:
            digest.update(f.read())
    print(
        f"one {size / 1e6:.1f} MB JSON line, {workers} worker(s): {secs:.1f} s, "
        f"{rss / 2**20:.0f} MiB peak RSS; .bin+.idx sha256 {digest.hexdigest()[:16]}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=30.0, help="corpus size in MB (30)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--docs", type=int, default=10_000_000, help="documents for the index bench")
    p.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    p.add_argument(
        "--huge-doc-mb",
        type=float,
        default=None,
        help="measure only one JSON line holding a document of this many MB",
    )
    args = p.parse_args()
    if args.huge_doc_mb is not None:
        bench_huge_document(args.huge_doc_mb, args.workers, args.out)
        return
    py = sys.executable
    corpus = os.path.join(args.out, "stdlib.jsonl")
    docs, nbytes = write_stdlib_corpus(corpus, int(args.mb * 1e6))
    tok_dir = os.path.join(args.out, "bpe8k")
    if not os.path.exists(os.path.join(tok_dir, "merges.txt")):
        subprocess.run(
            [
                py,
                f"{ROOT}/tools/train_tokenizer.py",
                "--input",
                corpus,
                "--type",
                "bpe",
                "--vocab-size",
                "8192",
                "--output-dir",
                tok_dir,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    rows = []
    outputs = {}
    for workers in sorted({1, args.workers}):
        prefix = os.path.join(args.out, f"w{workers}")
        secs, rss = run_measured(preprocess_cmd(corpus, prefix, tok_dir, workers))
        outputs[workers] = prefix + "_text_document"
        rows.append(
            (
                f"preprocess, {workers} worker(s)",
                f"{secs:.2f} s",
                f"{nbytes / 1e6 / secs:.2f} MB/s",
                f"{rss / 2**20:.0f} MiB peak RSS",
            )
        )
    same = all(
        filecmp.cmp(f"{outputs[1]}{ext}", f"{outputs[args.workers]}{ext}", shallow=False)
        for ext in (".bin", ".idx")
    )
    rng = np.random.default_rng(0)
    sizes = rng.integers(50, 2000, args.docs).astype(np.int32)
    documents = np.arange(args.docs, dtype=np.int32)
    num_samples = int(sizes.sum(dtype=np.int64)) // 2048
    t = time.monotonic()
    idx = build_indices(sizes, documents, num_samples, 2048, 1234)
    index_secs = time.monotonic() - t
    rows.append(
        (
            f"GPT indices, {args.docs:,} docs",
            f"{index_secs:.2f} s",
            f"{len(idx['shuffle_idx']):,} samples",
            "seq 2048, 1 epoch",
        )
    )
    t = time.monotonic()
    build_blending_indices([0.3, 0.7], num_samples)
    rows.append(
        (
            f"blend indices, {num_samples:,} samples",
            f"{time.monotonic() - t:.2f} s",
            "2 datasets",
            "",
        )
    )
    print(
        f"\ncorpus: {docs} documents, {nbytes / 1e6:.1f} MB; outputs of 1 and "
        f"{args.workers} workers identical: {same}\n"
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
