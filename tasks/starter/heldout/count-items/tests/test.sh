#!/bin/bash
# Writes the reward (1 or 0) to /logs/verifier/reward.txt; the exit status is not the verdict.
mkdir -p /logs/verifier
if [ "$(tr -d " \n" < /app/total.txt)" = 4 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
