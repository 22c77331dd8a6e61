#!/usr/bin/python3
"""The outcome of every spec the focus names, from ginkgo's JUnit files in
DIR: passed, failed, or skipped with the reason (left out by a line of
EXCLUDED, "regex<TAB>reason", or skipped by the spec itself at run time),
then the counts.

usage: junit_summary.py DIR FOCUS EXCLUDED
"""
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET


def main():
    report, focus = sys.argv[1], re.compile(sys.argv[2])
    with open(sys.argv[3]) as f:
        excluded = [(re.compile(regex), reason) for regex, reason in
                    (line.rstrip("\n").split("\t", 1) for line in f if line.strip())]
    outcomes = {}
    for path in sorted(glob.glob(os.path.join(report, "junit_*.xml"))):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name", "")
            if not focus.search(name):
                continue
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                outcomes[name] = ("failed", (failure.get("message") or "").strip().splitlines()[:1])
            elif skipped is not None:
                reasons = [reason for regex, reason in excluded if regex.search(name)]
                if reasons:
                    why = ["left out: " + reasons[0]]
                else:
                    why = [(skipped.get("message") or "skipped by the spec").strip().splitlines()[0]]
                outcomes.setdefault(name, ("skipped", why))
            else:
                outcomes[name] = ("passed", [])
    counts = {}
    for name in sorted(outcomes):
        outcome, why = outcomes[name]
        counts[outcome] = counts.get(outcome, 0) + 1
        print("%-7s %s%s" % (outcome, name, ("  (" + why[0] + ")") if why else ""))
    print("e2e: " + ", ".join("%d %s" % (n, o) for o, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
