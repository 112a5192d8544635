#!/bin/bash
tac /app/steps.txt > /app/reversed.txt
