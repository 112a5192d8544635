#!/bin/bash
tail -n 1 /app/history.txt > /app/last.txt
