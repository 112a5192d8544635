#!/bin/bash
mkdir -p /app/logs
