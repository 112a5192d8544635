"""Compares /app/by_country.json with the grouping of /app/users.json."""
import json
import sys

users = json.load(open("/app/users.json"))
want = {}
for user in users:
    want.setdefault(user["country"], []).append(user)
want = {
    c: {"names": sorted(u["name"] for u in us),
        "mean_age": round(sum(u["age"] for u in us) / len(us), 1)}
    for c, us in want.items()
}
try:
    got = json.load(open("/app/by_country.json"))
except (OSError, ValueError) as exc:
    sys.exit(f"cannot read by_country.json: {exc}")
if got != want:
    sys.exit(f"expected {want}, got {got}")
print("ok")
