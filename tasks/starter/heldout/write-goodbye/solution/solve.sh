#!/bin/bash
echo goodbye > /app/bye.txt
