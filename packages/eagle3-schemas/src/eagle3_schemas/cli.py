"""``eagle3-schemas``: validate artifacts, check and freeze the schema files."""

from __future__ import annotations

import argparse
import sys

from eagle3_schemas.contract.meta_check import freeze, meta_check
from eagle3_schemas.contract.validate import validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3-schemas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_validate = sub.add_parser(
        "validate", help="validate artifacts; exit 1 listing every violation"
    )
    p_validate.add_argument("paths", nargs="+", metavar="PATH")
    p_validate.add_argument(
        "--shallow",
        action="store_true",
        help="skip checks that read every stored value (checksums, NaN scans)",
    )
    sub.add_parser(
        "meta-check", help="check the schema files themselves and the frozen-version lock"
    )
    sub.add_parser("freeze", help="record the hash of every not-yet-frozen schema file (a release)")
    args = parser.parse_args(argv)

    if args.command == "validate":
        failed = 0
        for path in args.paths:
            violations = validate(path, deep=not args.shallow)
            if violations:
                failed += 1
                print(f"INVALID {path}: {len(violations)} violation(s)")
                for v in violations:
                    print(f"  {v}")
            else:
                print(f"ok      {path}")
        return 1 if failed else 0
    if args.command == "meta-check":
        problems = meta_check()
        for problem in problems:
            print(problem)
        print(f"schema meta-check: {len(problems)} problem(s)")
        return 1 if problems else 0
    added = freeze()
    print("\n".join(f"frozen {rel}" for rel in added) or "nothing new to freeze")
    return 0


if __name__ == "__main__":
    sys.exit(main())
