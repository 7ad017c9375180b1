"""Fastest tile config per fused form from bench/fused_forms.py sweep JSONs (one per
TLX_DIST_FUSED_CONFIG round, the round's string in the matching .cfg file); prints the combined
override string. A form's time is the sum over the launches that use its config (scatter: scatter +
scatter_dx)."""
import json
import pathlib
import sys

BASE = {"swiglu": "swiglu", "scatter": "scatter", "scatter_dx": "scatter", "dswiglu": "dswiglu",
        "wgrad_a": "wgrad_a", "wgrad_b": "wgrad_b"}
best = {}
for path in sys.argv[1:]:
    p = pathlib.Path(path)
    cfg = p.with_suffix(".cfg").read_text().strip() if p.with_suffix(".cfg").exists() else ""
    parts = {}
    for name, fields in (x.split(":", 1) for x in cfg.split(";") if x):
        for form in (("wgrad_a", "wgrad_b") if name == "wgrad" else (name,)):  # the alias sets both
            parts[form] = fields
    times = {}
    for r in json.loads(p.read_text())["rows"]:
        times[BASE[r["form"]]] = times.get(BASE[r["form"]], 0.0) + r["fused_ms"]
    for form, t in times.items():
        if form not in best or t < best[form][0]:
            best[form] = (t, parts.get(form))
print(";".join(f"{f}:{c}" for f, (t, c) in sorted(best.items()) if c))
for f, (t, c) in sorted(best.items()):
    print(f"{f}: {t:.3f} ms with {c or 'the default'}", file=sys.stderr)
