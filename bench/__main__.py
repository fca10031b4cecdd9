"""Entry point: python -m bench <program> [args]."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench demo|collectives|compressed|ckpt|netsim [args]")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "demo":
        from .demo import main as run
    else:
        print(f"bench: unknown program {name!r}; expected one of: demo", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
