"""``python -m megatron_burst.bench <name> [options]``: attention | kernels | multinode | loss | ckpt | linear | sparse | gpu
| documents, and ``verdict OUT_DIR`` (a GPU session's results against the open issues' bars)."""
import importlib
import sys

BENCHES = {
    "attention": "megatron_burst.bench.attention",
    "kernels": "megatron_burst.bench.kernels",
    "multinode": "megatron_burst.bench.multinode",
    "loss": "megatron_burst.bench.loss",
    "ckpt": "megatron_burst.bench.ckpt",
    "linear": "megatron_burst.bench.linear",
    "sparse": "megatron_burst.bench.sparse",
    "gpu": "megatron_burst.bench.gpu",
    "documents": "megatron_burst.bench.documents",
    "verdict": "megatron_burst.bench.verdict",
}


USAGE = (f"usage: python -m megatron_burst.bench {{{','.join(BENCHES)}}} [options]\n"
         "  python -m megatron_burst.bench <name> --help   lists that benchmark's options")


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        got = f"unknown benchmark {sys.argv[1]!r}\n" if len(sys.argv) >= 2 else ""
        print(got + USAGE, file=sys.stderr)
        sys.exit(2)
    importlib.import_module(BENCHES[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
