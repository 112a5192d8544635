#!/bin/bash
chmod +x /app/run.sh
