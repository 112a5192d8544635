#!/bin/bash
awk '$9 == 404 {n[$1]++} END {for (ip in n) print ip, n[ip]}' /app/access.log \
  | LC_ALL=C sort -k2,2nr -k1,1 > /app/404s.txt
