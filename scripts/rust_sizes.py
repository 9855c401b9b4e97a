#!/usr/bin/env python3
"""(The team's size check, kept here so that scripts/test.sh runs it in any clone.)
Sizes of non-test Rust code: every fn longer than MAX_FN lines and every file whose non-test lines exceed
MAX_FILE, under the given source roots. Test modules (#[cfg(test)] mod ... { }) are left out, and so are
tests/ and benches/ folders. Usage: rust_sizes.py MAX_FN MAX_FILE ROOT... ; prints offenders, exits 1 if any."""
import os, re, sys

def strip_strings(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split('//', 1)[0]

def blocks(lines):
    """Yield (start, end) line indexes of brace blocks opened on `start`."""
    stack = []
    for i, raw in enumerate(lines):
        for ch in strip_strings(raw):
            if ch == '{':
                stack.append(i)
            elif ch == '}' and stack:
                yield stack.pop(), i

def main():
    max_fn, max_file, roots = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    bad = []
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in ('tests', 'benches', 'target')]
            for f in files:
                if not f.endswith('.rs'):
                    continue
                p = os.path.join(d, f)
                lines = open(p, encoding='utf-8', errors='replace').read().split('\n')
                spans = list(blocks(lines))
                test = set()
                for s, e in spans:   # a block opened by `mod x {` right after #[cfg(test)]
                    head = ' '.join(lines[max(0, s - 2):s + 1])
                    if re.search(r'#\[cfg\(test\)\]', head) and re.search(r'\bmod\s+\w+', lines[s]):
                        test.update(range(s, e + 1))
                code = sum(1 for i, l in enumerate(lines) if i not in test and l.strip())
                if code > max_file:
                    bad.append(f"file {p}: {code} non-test lines > {max_file}")
                starts = {}
                for s, e in spans:
                    starts.setdefault(s, e)
                for i, l in enumerate(lines):
                    if i in test:
                        continue
                    m = re.match(r'\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)', l)
                    if not m:
                        continue
                    j = i   # the body opens on the first line with '{' at or after the signature
                    while j < len(lines) and j not in starts and ';' not in strip_strings(lines[j]):
                        j += 1
                    if j in starts:
                        n = starts[j] - i + 1
                        if n > max_fn:
                            bad.append(f"fn {p}:{i + 1} {m.group(7)}: {n} lines > {max_fn}")
    for b in bad:
        print(b)
    sys.exit(1 if bad else 0)

main()
