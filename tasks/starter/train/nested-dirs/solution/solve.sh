#!/bin/bash
mkdir -p /app/a/b/c
