#!/bin/bash
cd /app/project
git init -q -b main .
git add -A
git -c user.name="Riptide Bot" -c user.email="bot@example.com" commit -q -m "Initial import"
