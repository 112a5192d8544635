#!/bin/bash
tail -n +2 /app/scores.csv | cut -d, -f1 > /app/names.txt
