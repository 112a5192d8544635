#!/bin/bash
{
  echo "product,revenue"
  tail -n +2 /app/sales.csv | awk -F, '{rev[$2] += $3 * $4} END {for (p in rev) printf "%s,%.2f\n", p, rev[p]}' \
    | sort -t, -k2,2nr
} > /app/revenue.csv
