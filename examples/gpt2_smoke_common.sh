# Sourced by the example launchers (needs ROOT and PY): the GPT-2 tokenizer flags (GPT-2's own
# files, shipped in the package, unless VOCAB and MERGES name others) and, for SMOKE=1, a small
# corpus of the Python standard library's sources written once to $DATA.
TOKENIZER=(--tokenizer-type GPT2BPETokenizer)
if [ -n "${VOCAB:-}" ] || [ -n "${MERGES:-}" ]; then
    TOKENIZER+=(--vocab-file "${VOCAB:?VOCAB and MERGES go together}"
                --merge-file "${MERGES:?VOCAB and MERGES go together}")
fi

smoke_corpus() {  # smoke_corpus DIR DATA: build DATA.bin/.idx under DIR unless it exists
    local dir=$1 data=$2
    [ -f "$data.idx" ] && return 0
    mkdir -p "$dir"
    PYTHONPATH="$ROOT" "$PY" -c "from megatron.data.stdlib_corpus import write_stdlib_corpus \
as w; w('$dir/corpus.jsonl', 400_000)"
    "$PY" "$ROOT/tools/preprocess_data.py" --input "$dir/corpus.jsonl" \
        --output-prefix "$dir/corpus" "${TOKENIZER[@]}" --append-eod
}
