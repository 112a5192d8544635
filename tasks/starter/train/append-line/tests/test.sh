#!/bin/bash
# Writes the reward (1 or 0) to /logs/verifier/reward.txt; the exit status is not the verdict.
mkdir -p /logs/verifier
if [ "$(cat /app/todo.txt)" = "$(printf "write code\ntest code\ndone")" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
