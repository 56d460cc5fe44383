"""mspretrain.data"""
