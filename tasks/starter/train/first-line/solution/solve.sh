#!/bin/bash
head -n 1 /app/poem.txt > /app/first.txt
