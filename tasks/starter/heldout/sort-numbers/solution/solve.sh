#!/bin/bash
sort -n /app/nums.txt > /app/sorted.txt
