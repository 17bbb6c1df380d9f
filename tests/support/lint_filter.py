"""Fail `snakemake --lint` on every finding except the deliberate ones (README, "Lint findings").

Reads the linter's text output on stdin. Allowed: rules without a conda env or container
(eagleflow runs in one pinned venv, built by `make`, on the local machine and the GPU host alike).
"""

import re
import sys

ALLOWED = {"Specify a conda environment or container for each rule."}

text = sys.stdin.read()
if "Lints for" not in text and "Congratulations" not in text:
    sys.exit(f"snakemake --lint did not run:\n{text}")
findings = re.findall(r"^\s+\* (.+?):?$", text, flags=re.M)
bad = sorted({f for f in findings if f.rstrip(":") not in ALLOWED and f not in ALLOWED})
if bad:
    sys.exit(f"snakemake --lint findings that are not deliberate:\n{text}")
print(
    f"snakemake --lint: {len(findings)} deliberate finding(s) only ({'; '.join(sorted(ALLOWED))})"
)
