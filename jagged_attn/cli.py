"""Command line: ``jagged-attn demo | preprocess | inspect``."""

from __future__ import annotations

import argparse
import sys

from .backends import BACKENDS, DEPRECATED_NAMES
from .mx_format import ROUNDINGS


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jagged-attn", description="Varlen MXFP8 attention for ragged batches")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="ragged batch -> MXFP8 -> attention fwd+bwd; accuracy vs fp64 and time")
    demo.add_argument("--lengths", type=_lengths, default=None, help="comma-separated sequence lengths")
    demo.add_argument("--heads", type=int, default=8, help="query heads")
    demo.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    demo.add_argument("--head-dim", type=int, default=128)
    demo.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    demo.add_argument("--backend", default="auto", choices=(*BACKENDS, *DEPRECATED_NAMES))  # old names: one release
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")

    pre = sub.add_parser("preprocess", help="quantize a jagged tensor file to MXFP8 offline")
    pre.add_argument("input")
    pre.add_argument("output")
    pre.add_argument("--axis", default="feature", choices=["feature", "sequence", "both"])
    pre.add_argument("--rounding", default="rceil", choices=ROUNDINGS)
    pre.add_argument("--heads", type=int, default=None, help="reshape [total, H*D] values to [total, H, D]")
    pre.add_argument("--device", default="cpu", help="where chunks are quantized: cpu, or cuda (fused Triton kernel)")
    pre.add_argument("--chunk-tokens", type=int, default=None, help="tokens per chunk (default: ~16M values)")
    pre.add_argument("--force", action="store_true", help="replace an existing output file")
    pre.add_argument("--no-progress", action="store_true",
                     help="no progress line on stderr (it is shown only when stderr is a terminal)")

    insp = sub.add_parser("inspect", help="summarize a preprocessed MXFP8 file")
    insp.add_argument("file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import DEFAULT_LENGTHS, run_demo

            run_demo(lengths=args.lengths or DEFAULT_LENGTHS, heads_q=args.heads, heads_kv=args.kv_heads,
                     head_dim=args.head_dim, causal=not args.no_causal, backend=args.backend, device=args.device)
        elif args.command == "preprocess":
            from .preprocess import preprocess_file

            stats = preprocess_file(args.input, args.output, axis=args.axis, rounding=args.rounding, heads=args.heads,
                                    device=args.device, chunk_tokens=args.chunk_tokens, overwrite=args.force,
                                    progress=sys.stderr.isatty() and not args.no_progress)
            print(f"wrote {stats['output']}: {stats['sequences']} sequences, {stats['tokens']} tokens, "
                  f"{stats['output_bytes'] / 2**20:.1f} MiB ({stats['input_bytes'] / 2**20:.1f} MiB in), "
                  f"{stats['tokens_per_s']:.0f} tokens/s, {stats['checksum']}")
        else:
            from .preprocess import inspect_file

            print(inspect_file(args.file))
    except (ValueError, TypeError, OSError) as e:  # OSError: missing, existing or unwritable files, a full disk
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # torch's span lines
        print(f"jagged-attn {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
