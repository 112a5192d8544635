#!/bin/bash
tail -n +2 /app/people.csv | wc -l > /app/rows.txt
