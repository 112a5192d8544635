#!/bin/bash
wc -w < /app/sentence.txt > /app/words.txt
