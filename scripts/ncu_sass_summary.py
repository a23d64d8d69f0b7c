"""Where a kernel's warps stall, from Nsight Compute's source page (SASS, CSV).

Usage: python3 scripts/ncu_sass_summary.py SASS.csv[.gz] [TOP]

Reads `ncu --import REP --page source --csv --print-source sass` (collected with the
SourceCounters section) and prints the warp-stall samples by stall reason, by opcode (the
predicate dropped), the executed instructions by opcode, and the TOP instructions (20 by
default) with the most samples.
"""

import collections
import csv
import gzip
import re
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if header_at is None:
        sys.exit(f"{path}: no `Source` column (was it written with --page source --csv?)")
    header, data = rows[header_at], [r for r in rows[header_at + 1 :] if len(r) == len(rows[header_at])]
    col = {h: i for i, h in enumerate(header)}
    samples_col = col.get("Warp Stall Sampling (All Samples)")
    if samples_col is None:
        sys.exit(f"{path}: no warp-stall samples (collect with --section SourceCounters)")

    def number(row, name):
        value = row[col[name]].replace(",", "")
        return int(value) if value.isdigit() else 0

    def opcode(row):
        text = re.sub(r"^@!?U?P\w+\s+", "", row[col["Source"]].strip())
        return text.split()[0] if text else "?"

    samples = sum(number(r, "Warp Stall Sampling (All Samples)") for r in data)
    if samples == 0:
        sys.exit(f"{path}: no samples")
    reasons = collections.Counter()
    for name in (h for h in header if h.startswith("stall_") and "Not Issued" not in h):
        reasons[name[len("stall_") :]] = sum(number(r, name) for r in data)
    by_opcode, executed = collections.Counter(), collections.Counter()
    for r in data:
        by_opcode[opcode(r)] += number(r, "Warp Stall Sampling (All Samples)")
        executed[opcode(r)] += number(r, "Instructions Executed")
    total_executed = max(sum(executed.values()), 1)
    share = lambda counter, total, n: ", ".join(f"{k} {v / total:.1%}" for k, v in counter.most_common(n))
    print(f"{samples} samples over {len(data)} instructions")
    print(f"stall reasons: {share(reasons, samples, 10)}")
    print(f"samples by opcode: {share(by_opcode, samples, 12)}")
    print(f"executed by opcode ({total_executed} warp instructions): {share(executed, total_executed, 12)}")
    for r in sorted(data, key=lambda r: -number(r, "Warp Stall Sampling (All Samples)"))[:top]:
        print(f"{number(r, 'Warp Stall Sampling (All Samples)') / samples:6.1%}  {r[col['Source']].strip()[:80]}")


if __name__ == "__main__":
    main()
