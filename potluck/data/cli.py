"""``potluck data``: prepare token shards from text (``potluck data prepare``).

:func:`register` adds the command to ``potluck``'s parser; ``python -m potluck.data.cli prepare ...``
runs it alone. Building the parser imports nothing heavy: numpy and the tokenizer libraries load
when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Data for a run: token shards that peers read by memory map. 'prepare'
tokenizes text, jsonl, parquet or a Hugging Face dataset into fixed-size
shards and an index.json whose sha256 names the data set in the manifest."""

PREPARE_DESCRIPTION = """\
Tokenize text into the token shards a run trains on: fixed-size files of
uint16 (uint32 past 65536 ids) tokens per split, train and eval, and an
index.json with every file's sha256 and the tokenizer's identity. Inputs are
.txt (a document per file, or per line with --lines), .jsonl / .jsonl.gz (a
document per line, in --text-field) and .parquet (the --text-field column), or
a Hugging Face dataset, streamed (--dataset). The same inputs and tokenizer
give the same files on any machine with any --workers: index.json's sha256
names the data set in the run's manifest. The last --eval-fraction of the
documents become the eval split, unless --eval names its files."""

PREPARE_EXAMPLES = """\
examples:
  potluck data prepare --tokenizer bytes --out shards corpus.txt
  potluck data prepare --tokenizer tok/tokenizer.json --out shards --lines books
  potluck data prepare --tokenizer gpt2 --out shards --workers 8 data/*.jsonl.gz
  potluck data prepare --tokenizer gpt2 --out shards --eval dev.jsonl a.jsonl
  potluck data prepare --tokenizer gpt2 --out shards --dataset org/stories"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` command (and its ``prepare`` subcommand) to ``potluck``'s subparsers."""
    data = subparsers.add_parser("data", help="prepare token shards from text, jsonl, parquet or a dataset",
                                 description=DESCRIPTION, epilog=PREPARE_EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND", title="subcommands")
    p = sub.add_parser("prepare", help="tokenize inputs into shards + index.json", description=PREPARE_DESCRIPTION,
                       epilog=PREPARE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, metavar="FILES",
                   help="input files or folders (folders: their .txt/.jsonl/.jsonl.gz/.parquet files, sorted)")
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="'bytes' (UTF-8 bytes, vocabulary 256), a tokenizer.json, a folder holding one, or a Hugging "
                   "Face Hub id")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder (index.json, train/, eval/)")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="tokenizer processes (default 2)")
    p.add_argument("--shard-tokens", type=int, default=1 << 24, metavar="N",
                   help="tokens per shard file (default 16777216)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the jsonl field / parquet or dataset column holding the text (default 'text')")
    p.add_argument("--lines", action="store_true", help=".txt inputs: every non-empty line is a document")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--eval-fraction", type=float, default=0.005, metavar="F",
                      help="the last F of the documents (at least one) form the eval split; 0: none (default 0.005)")
    held.add_argument("--eval", action="append", type=Path, metavar="FILE",
                      help="the eval split's own input file (repeatable); then no training document is held out")
    p.add_argument("--dataset", metavar="NAME", help="a Hugging Face dataset, streamed, instead of FILES "
                   "(needs potluck[data])")
    p.add_argument("--dataset-config", metavar="C", help="the --dataset's configuration (subset)")
    p.add_argument("--dataset-split", default="train", metavar="S", help="the --dataset's split (default train)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out that is not a previous prepare "
                   "(its index.json, train/ and eval/ are replaced; nothing else is touched)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary line on stderr")
    p.set_defaults(fn=run_prepare)
    return data


def run_prepare(args: argparse.Namespace) -> int:
    from potluck.data import DataError

    try:
        if bool(args.files) == bool(args.dataset):
            raise DataError("give input FILES or --dataset NAME (one of the two)")
        if args.dataset and args.eval:
            raise DataError("--eval FILE goes with input FILES; with --dataset use --eval-fraction")
        if args.workers < 1:
            raise DataError(f"--workers must be at least 1, got {args.workers}")
        from potluck.data.prepare import prepare, prepare_dataset
        from potluck.data.shards import ShardSet
        from potluck.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        common = {"workers": args.workers, "shard_tokens": args.shard_tokens, "text_field": args.text_field,
                  "eval_fraction": args.eval_fraction, "progress": not args.quiet, "force": args.force}
        if args.dataset:
            out = prepare_dataset(args.dataset, tokenizer, args.out, config=args.dataset_config,
                                  split=args.dataset_split, **common)
        else:
            out = prepare(args.files, tokenizer, args.out, eval_files=args.eval, lines=args.lines, **common)
        shards = ShardSet.open(out, verify="none")
    except (DataError, OSError) as err:
        print(f"potluck data prepare: error: {err}", file=sys.stderr)
        return 2
    print(f"{out}: {shards.num_tokens} training tokens; index sha256 {shards.index_sha256}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m potluck.data.cli prepare ...``: the ``potluck data`` command on its own."""
    parser = argparse.ArgumentParser(prog="potluck")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *(sys.argv[1:] if argv is None else argv)])
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
