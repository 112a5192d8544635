#!/bin/bash
touch /app/ready.txt
