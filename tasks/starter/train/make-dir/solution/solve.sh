#!/bin/bash
mkdir -p /app/build
