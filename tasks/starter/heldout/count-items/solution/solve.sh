#!/bin/bash
wc -l < /app/items.txt > /app/total.txt
