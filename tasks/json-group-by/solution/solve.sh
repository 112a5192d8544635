#!/bin/bash
python3 - <<'PY'
import json
users = json.load(open("/app/users.json"))
out = {}
for u in users:
    out.setdefault(u["country"], []).append(u)
out = {c: {"names": sorted(x["name"] for x in us),
           "mean_age": round(sum(x["age"] for x in us) / len(us), 1)} for c, us in out.items()}
json.dump(out, open("/app/by_country.json", "w"), indent=2)
PY
