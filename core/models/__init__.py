"""What a FLUX model is: recognising one, meeting current ComfyUI's loaders, and synthetic random-weight models."""
