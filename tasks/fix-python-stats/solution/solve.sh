#!/bin/bash
cd /app
sed -i 's/return \[int(line)/return [float(line)/' stats.py
sed -i 's|return sum(values) / len(values) - 1|return sum(values) / len(values)|' stats.py
python3 - <<'PY'
path = "/app/stats.py"
src = open(path).read()
src = src.replace(
    "    return values[middle]\n",
    "    if len(values) % 2:\n        return values[middle]\n"
    "    return (values[middle - 1] + values[middle]) / 2\n",
)
open(path, "w").write(src)
PY
