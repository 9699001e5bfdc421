"""Fuse runs into one: `vembed fuse RUN RUN [...] --out fused.trec [--method rrf|weighted|...] [--weights ...]`.

The fusion is ranx's (`vembed.evaluation.fusion`); the runs are TREC run files (`vembed search`'s of a dense, a
late-interaction and a BM25 first stage, or any tool's). With `--corpus FOLDER` the fused run's metrics on the split
are printed beside each input's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vembed.evaluation.fusion import METHODS, NORMS, RRF_K


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="two or more TREC run files")
    parser.add_argument("--out", required=True, help="the fused run file to write (TREC; .jsonl: JSON rows)")
    parser.add_argument("--method", choices=list(METHODS), default="rrf",
                        help="rrf: reciprocal rank fusion (default); weighted: a weighted sum of normalised scores "
                             "(--weights); sum, mnz, max, min, med, anz, isr, bordafuse, condorcet: ranx's methods")
    parser.add_argument("--weights", type=float, nargs="+", help="--method weighted: one weight per run, in order")
    parser.add_argument("--rrf-k", "--rrf_k", type=int, default=RRF_K,
                        help=f"--method rrf: the k in 1 / (k + rank) (default {RRF_K})")
    parser.add_argument("--norm", choices=NORMS, default="min-max",
                        help="how each run's scores are normalised per query before they are combined (default "
                             "min-max; rank-based methods such as rrf ignore scores)")
    parser.add_argument("--top-k", "--top_k", type=int,
                        help="keep each query's best K of the fused list (default: all)")
    parser.add_argument("--tag", default=None, help="the run's name in its last column (default: the method)")
    parser.add_argument("--corpus", help="a corpus folder: print the metrics of each run and of the fused one on "
                                         "--split (and write JSONL rows with texts)")
    parser.add_argument("--split", default="test", help="with --corpus: the qrels split measured (default test)")
    parser.add_argument("--format", choices=["trec", "jsonl"], default=None,
                        help="trec or jsonl (default: jsonl for a .jsonl --out, else trec; jsonl texts need --corpus)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import require_at_least_one, run_cli

    def body() -> int:
        from vembed.entrypoints.search import check_run_output, output_format
        from vembed.errors import ArgumentError, require_package
        from vembed.evaluation.fusion import check_fusion_arguments, fuse_runs
        from vembed.evaluation.runs import cut, read_run, write_run

        require_at_least_one(top_k=args.top_k)
        check_fusion_arguments(args.runs, args.method, args.weights, args.rrf_k, args.norm)
        require_package("ranx", "vembed fuse", "fusion", "search")
        check_run_output(args)
        fmt = output_format(args)
        if fmt == "jsonl" and args.corpus is None:
            raise ArgumentError("--format", "jsonl rows carry the texts: give --corpus FOLDER, or write trec")
        for path in args.runs:
            if not Path(path).is_file():
                raise ArgumentError("runs", f"{path} is not a file; give TREC run files")
            if Path(path).resolve() == Path(args.out).resolve():
                raise ArgumentError("--out", f"{args.out} is one of the runs being fused; write the fused run "
                                             "elsewhere")
        split = _split(args)
        runs = [read_run(path) for path in args.runs]
        if split is not None:
            from vembed.evaluation.runs import check_documents_in_corpus

            for path, one in zip(args.runs, runs):
                check_documents_in_corpus(one, split, path)
        fused = fuse_runs(runs, args.method, weights=args.weights, k=args.rrf_k, norm=args.norm)
        if args.top_k is not None:
            fused = cut(fused, args.top_k)
        write_run(args.out, fused, tag=args.tag or args.method, format=fmt, split=split)
        if split is not None:
            print(_metrics_table(args.runs, runs, fused, split))
        print(f"wrote {args.out} ({fmt}): {len(fused)} queries fused from {len(runs)} runs by {args.method}")
        return 0

    return run_cli(body, args.debug)


def _split(args: argparse.Namespace):
    from vembed.data.corpus import CorpusSource

    if args.corpus is None:
        return None
    source = CorpusSource(None, args.corpus, args.split, None, "--split")
    source.check()
    return source.load()


def _metrics_table(paths: list[str], runs: list, fused, split) -> str:
    """nDCG@10, recall@100, MAP@100 and MRR@10 of each run and of the fused one, a row each."""
    from vembed.evaluation.corpus import corpus_metrics

    names = ["ndcg@10", "recall@100", "map@100", "mrr@10"]
    width = max(len("fused"), *(len(Path(p).name) for p in paths)) + 2
    lines = [f"{'run':<{width}}" + "".join(f"{name:>12}" for name in names)]
    for name, one in [*zip((Path(p).name for p in paths), runs), ("fused", fused)]:
        metrics = corpus_metrics(one, split.qrels)
        lines.append(f"{name:<{width}}" + "".join(f"{metrics[m]:>12.4f}" for m in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed fuse", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
