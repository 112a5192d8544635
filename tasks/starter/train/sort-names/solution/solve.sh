#!/bin/bash
sort /app/names.txt > /app/sorted.txt
