#!/bin/bash
sort -u /app/colors.txt > /app/unique.txt
