#!/usr/bin/env bash
# Placeholder until the model runtime lands: nothing to fetch yet.
echo "fetch_models: no models needed yet"
