#!/bin/bash
grep -o '\[[A-Z]*\]' /app/server.log | tr -d '[]' | sort | uniq -c \
  | awk '{print $2, $1}' | sort -k2,2nr -k1,1 > /app/summary.txt
