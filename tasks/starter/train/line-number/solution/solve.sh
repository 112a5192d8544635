#!/bin/bash
grep -n '^needle$' /app/hay.txt | cut -d: -f1 > /app/line.txt
