"""`hami-usage report`: chargeback over billing records - prices, groups, CSV and HTML."""
