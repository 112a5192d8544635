#!/bin/bash
grep WARN /app/server.log > /app/warnings.txt
