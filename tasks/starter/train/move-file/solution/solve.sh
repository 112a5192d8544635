#!/bin/bash
mv /app/draft.txt /app/final.txt
