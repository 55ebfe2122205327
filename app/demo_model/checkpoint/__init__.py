# Makes the checkpoint a package so setuptools ships its *.json/*.safetensors in the wheel.
