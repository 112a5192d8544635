#!/bin/bash
tr a-z A-Z < /app/word.txt > /app/upper.txt
