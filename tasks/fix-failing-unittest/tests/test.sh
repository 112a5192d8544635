#!/bin/bash
# Writes the reward (1 or 0) to /logs/verifier/reward.txt; the exit status is not the verdict.
mkdir -p /logs/verifier
if python3 /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
