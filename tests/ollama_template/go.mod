module ollamatemplate

go 1.19
