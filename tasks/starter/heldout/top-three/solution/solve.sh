#!/bin/bash
head -n 3 /app/list.txt > /app/top3.txt
