#!/bin/bash
cd /app/data
find . -type f -printf '%P\n' | LC_ALL=C sort | while IFS= read -r f; do sha256sum -- "$f"; done \
  > /app/SHA256SUMS
