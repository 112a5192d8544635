#!/bin/bash
cp /app/notes.txt /app/backup.txt
