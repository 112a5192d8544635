#!/bin/bash
sed -n 's/.*"name": *"\([^"]*\)".*/\1/p' /app/config.json > /app/name.txt
